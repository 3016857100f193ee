"""The EventBridge-compatible HTTP API (``eventpush api``): Amazon EventBridge's own wire
protocol (AWS JSON 1.1, Signature Version 4), so every AWS SDK and the AWS CLI publish and
manage without an eventpush client. The entry-point layer: it calls the catalog, the publish
path and the access keys, and nothing below calls it.

- ``app``: the ASGI app, ``/healthz`` and ``/metrics``; ``server``: uvicorn;
- ``auth``: SigV4 verification; ``errors``: AWS's error shapes; ``shapes``: members, ARNs, pages;
- ``service``: what one server process holds (settings, pool, caches, group publisher);
- one module per operation group: ``events``, ``buses``, ``rules``, ``targets``, ``archives``.
"""
