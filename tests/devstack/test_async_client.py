"""The local Kubernetes API through kubernetes_asyncio, as the provider's triggers use it."""

from __future__ import annotations

import asyncio

from kubernetes_asyncio import client, config, watch

from .support import simple_pod

NS = "default"


async def scenario(kubeconfig: str) -> dict:
    api = await config.new_client_from_config(config_file=kubeconfig)
    async with api:
        core = client.CoreV1Api(api)
        await core.create_namespaced_pod(
            NS,
            simple_pod(
                "async-pod", "echo async-1; sleep 0.5; echo async-2", metadata={"labels": {"suite": "async"}}
            ),
        )
        phases = []
        w = watch.Watch()
        async with w.stream(
            core.list_namespaced_pod, NS, label_selector="suite=async", timeout_seconds=20
        ) as stream:
            async for ev in stream:
                phases.append((ev["type"], ev["object"].status.phase))
                if ev["object"].status.phase in ("Succeeded", "Failed"):
                    break
        pod = await core.read_namespaced_pod("async-pod", NS)
        raw = await core.read_namespaced_pod_log("async-pod", NS, timestamps=True, _preload_content=False)
        text = (await raw.read()).decode()
        events = await core.list_namespaced_event(NS, field_selector="involvedObject.name=async-pod")
        await core.delete_namespaced_pod("async-pod", NS)
        return {"phases": phases, "pod": pod, "log": text, "events": [e.reason for e in events.items]}


def test_read_watch_and_logs_with_kubernetes_asyncio(kubeapi):
    result = asyncio.run(scenario(str(kubeapi.kubeconfig)))
    assert result["phases"][0][0] == "ADDED" and result["phases"][-1] == ("MODIFIED", "Succeeded")
    assert result["pod"].status.container_statuses[0].state.terminated.exit_code == 0
    lines = result["log"].splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["async-1", "async-2"]
    assert all(line[:4].isdigit() and line.split(" ", 1)[0].endswith("Z") for line in lines)
    assert {"Scheduled", "Started"} <= set(result["events"])
