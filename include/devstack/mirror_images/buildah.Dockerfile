# The dev stack's stand-in for quay.io/buildah/stable (include/devstack/mirror.py): Debian's buildah
# on the Debian-made base, set up as the official image is for rootless builds: user build (uid
# 1000) with subordinate ids for its user namespace, chroot isolation, VFS storage.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah uidmap >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && useradd --uid 1000 --create-home --home-dir /home/build build \
 && printf 'build:1:999\nbuild:1001:64535\n' > /etc/subuid \
 && printf 'build:1:999\nbuild:1001:64535\n' > /etc/subgid \
 && mkdir -p /home/build/.local/share/containers /home/build/.config/containers \
 && printf '[storage]\ndriver = "vfs"\n' > /home/build/.config/containers/storage.conf \
 && chown -R build:build /home/build
ENV BUILDAH_ISOLATION=chroot
USER build
WORKDIR /home/build
CMD ["buildah", "--help"]
