/* Preloaded into every container of the local Kubernetes API (LD_PRELOAD): a socket bound to
 * the wildcard address (0.0.0.0 or ::) is bound to the pod's own loopback address instead
 * (KUBETRAIN_POD_IP, 127.x.y.z), so that two pods on one machine can each listen on the same
 * port, as pods with network namespaces of their own do on a cluster. Built by
 * include/devstack/kubeapi/podnet.py with the system C compiler; statically linked programs
 * are not affected. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind)
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *ip = getenv("KUBETRAIN_POD_IP");
    struct in_addr pod;
    if (!ip || !addr || inet_pton(AF_INET, ip, &pod) != 1)
        return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            in4.sin_addr = pod;
            return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
        }
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        int v6only = 0;
        socklen_t optlen = sizeof v6only;
        memcpy(&in6, addr, sizeof in6);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr) &&
            getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen) == 0 && !v6only) {
            /* a dual-stack wildcard socket: its IPv4 side is the pod's address (::ffff:127.x.y.z) */
            memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
            in6.sin6_addr.s6_addr[10] = 0xff;
            in6.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&in6.sin6_addr.s6_addr[12], &pod, 4);
            return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return real_bind(fd, addr, len);
}
