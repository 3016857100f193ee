"""Targets: ``PutTargets``, ``ListTargetsByRule``, ``RemoveTargets``, onto the catalog's
target functions (the CLI's). A target's ``Id`` is our target's name.

- ``Arn``: an ``http(s)://`` or ``nats://`` URL (an eventpush extension: AWS would want an
  API destination's ARN), or another event bus's ARN, which becomes a bus-to-bus target
  (``bus://NAME``: the event is published on that bus, eventpush.bus_targets).
- ``Input`` -> our ``CONSTANT`` transform, ``InputPath`` -> ``JSONPATH``,
  ``InputTransformer`` -> ``TEMPLATE`` (EventBridge's own filling rules); none -> ``ORIGINAL``.
- ``RetryPolicy``: ``MaximumRetryAttempts`` N -> N + 1 attempts, ``MaximumEventAgeInSeconds``
  -> the target's maximum age.
- An API destination's ARN sends through that destination (its URL, method, connection and
  rate limit: eventpush.api.destinations).
- ``HttpParameters``: ``QueryStringParameters`` are added to the URL's query,
  ``PathParameterValues`` fill the URL's ``*`` wildcards in order (neither for an API
  destination, whose URL is its own); ``HeaderParameters`` are the target's headers.

An existing ``Id`` is updated in place (its runner keeps its offsets), as AWS does.
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

from eventpush import catalog
from eventpush.api.destinations import name_of_arn
from eventpush.api.errors import ApiError, validation
from eventpush.api.rules import rule_bus
from eventpush.api.service import BusView, Call
from eventpush.api.shapes import BUS_SCHEME, bus_arn, checked, optional, page, required, url_of_arn

MAX_TARGETS = 10
MAX_REMOVE = 100  # AWS: RemoveTargets takes 1-100 ids
# AWS's bounds for a target's RetryPolicy (N retries are N + 1 attempts here).
RETRY_ATTEMPTS = (0, 185)
EVENT_AGE_S = (60, 86_400)
UNSUPPORTED = (
    "RoleArn",
    "KinesisParameters",
    "RunCommandParameters",
    "EcsParameters",
    "BatchParameters",
    "SqsParameters",
    "RedshiftDataParameters",
    "SageMakerPipelineParameters",
    "DeadLetterConfig",
    "AppSyncParameters",
)


def _with_http_parameters(url: str, params: dict | None) -> str:
    if not params:
        return url
    if not url and (params.get("PathParameterValues") or params.get("QueryStringParameters")):
        raise validation(
            "HttpParameters: an API destination's URL is its own: give its query and path "
            "in its InvocationEndpoint"
        )
    for value in checked(params.get("PathParameterValues") or [], "PathParameterValues", list):
        if "*" not in url:
            raise validation("HttpParameters.PathParameterValues has more values than '*' in Arn")
        url = url.replace("*", str(value), 1)
    query = checked(params.get("QueryStringParameters") or {}, "QueryStringParameters", dict)
    if query:
        url += ("&" if "?" in url else "?") + urlencode(query)
    return url


def _transform(target: dict) -> tuple[str, object]:
    given = [m for m in ("Input", "InputPath", "InputTransformer") if target.get(m) is not None]
    if len(given) > 1:
        raise validation(f"a target takes one of Input, InputPath, InputTransformer, not {given}")
    if not given:
        return "ORIGINAL", None
    if given[0] == "Input":
        return "CONSTANT", checked(target["Input"], "Input", str)
    if given[0] == "InputPath":
        return "JSONPATH", checked(target["InputPath"], "InputPath", str)
    transformer = checked(target["InputTransformer"], "InputTransformer", dict)
    template = required(transformer, "InputTemplate")
    paths = checked(transformer.get("InputPathsMap") or {}, "InputPathsMap", dict)
    return "TEMPLATE", {"InputPathsMap": paths, "InputTemplate": template}


def _spec_fields(target: dict, bus: BusView) -> dict:
    """The TargetSpec fields a PutTargets entry sets."""
    for member in UNSUPPORTED:
        if target.get(member):
            raise validation(f"target member '{member}' is not supported by eventpush")
    arn = required(target, "Arn")
    destination = None
    if ":api-destination/" in arn:
        destination, url = name_of_arn(arn, "api-destination", bus.account, bus.region), ""
    else:
        url = url_of_arn(arn, bus.account, bus.region)
    params = optional(target, "HttpParameters", dict)
    url = _with_http_parameters(url, params)
    kind, spec = _transform(target)
    fields = {"url": url, "transform_kind": kind, "transform_spec": spec}
    if destination is not None:
        fields["destination"] = destination
    headers = checked((params or {}).get("HeaderParameters") or {}, "HeaderParameters", dict)
    if headers:
        fields["headers"] = tuple(headers.items())
    retry = optional(target, "RetryPolicy", dict)
    if retry:
        attempts = _within(retry, "MaximumRetryAttempts", RETRY_ATTEMPTS)
        if attempts is not None:
            fields["max_attempts"] = attempts + 1
        age = _within(retry, "MaximumEventAgeInSeconds", EVENT_AGE_S)
        if age is not None:
            fields["max_age_s"] = age
    return fields


def _within(retry: dict, member: str, bounds: tuple[int, int]) -> int | None:
    """A ``RetryPolicy`` member within AWS's bounds for it (None when not given)."""
    value = retry.get(member)
    if value is None:
        return None
    value = checked(value, member, int)
    low, high = bounds
    if not low <= value <= high:
        raise validation(f"member 'RetryPolicy.{member}' must be between {low} and {high}")
    return value


def _put_one(conn, bus: str, rule: str, target_id: str, fields: dict) -> None:
    try:
        catalog.get_target(conn, bus, rule, target_id)
    except catalog.NotFoundError:
        catalog.create_target(conn, bus, rule, catalog.TargetSpec(name=target_id, **fields))
        catalog.assign(conn)  # pushed at once by an enabled worker, as on AWS
        return
    catalog.update_target(conn, bus, rule, target_id, **fields)


async def put_targets(call: Call, body: dict) -> dict:
    rule = required(body, "Rule")
    targets = required(body, "Targets", list)
    if not 1 <= len(targets) <= MAX_TARGETS:
        raise validation(f"member 'Targets' must hold 1 to {MAX_TARGETS} targets")
    bus = await rule_bus(call, body)
    await call.db(catalog.get_rule, bus.name, rule)  # an unknown rule refuses the request whole
    # What refuses the request whole is found before any target is written: each target is
    # its own commit, so a refusal after one would leave it written.
    targets = [checked(target, "Targets", dict) for target in targets]
    target_ids = [required(target, "Id") for target in targets]
    failed = []
    for target, target_id in zip(targets, target_ids, strict=True):
        try:
            fields = _spec_fields(target, bus)
            await call.db(_put_one, bus.name, rule, target_id, fields)
        except ApiError as exc:
            failed.append(
                {"TargetId": target_id, "ErrorCode": exc.code, "ErrorMessage": exc.message}
            )
    return {"FailedEntryCount": len(failed), "FailedEntries": failed}


def _failed(target_id: object, exc: ApiError) -> dict:
    return {"TargetId": target_id, "ErrorCode": exc.code, "ErrorMessage": exc.message}


def arn_of_url(call: Call, url: str, account: str, region: str, destination=None) -> str:
    if destination is not None:
        return f"arn:aws:events:{region}:{account}:api-destination/{destination}"
    if url.startswith(BUS_SCHEME):
        return bus_arn(account, region, url.removeprefix(BUS_SCHEME))
    return url


def target_shape(call: Call, info, account: str, region: str) -> dict:
    shape = {"Id": info.name, "Arn": arn_of_url(call, info.url, account, region, info.destination)}
    if info.headers:
        shape["HttpParameters"] = {"HeaderParameters": dict(info.headers)}
    if info.transform_kind == "CONSTANT":
        spec = info.transform_spec
        shape["Input"] = spec if isinstance(spec, str) else json.dumps(spec)
    elif info.transform_kind == "JSONPATH":
        spec = info.transform_spec
        shape["InputPath"] = spec if isinstance(spec, str) else spec["path"]
    elif info.transform_kind == "TEMPLATE":
        spec = info.transform_spec
        spec = json.loads(spec) if isinstance(spec, str) else spec
        shape["InputTransformer"] = {
            "InputPathsMap": spec.get("InputPathsMap", {}),
            "InputTemplate": spec["InputTemplate"],
        }
    shape["RetryPolicy"] = {
        "MaximumRetryAttempts": info.max_attempts - 1,
        "MaximumEventAgeInSeconds": info.max_age_s,
    }
    return shape


async def list_targets_by_rule(call: Call, body: dict) -> dict:
    rule = required(body, "Rule")
    bus = await rule_bus(call, body)
    await call.db(catalog.get_rule, bus.name, rule)
    infos = await call.db(catalog.list_targets, bus.name, rule)
    chunk, token = page(infos, body, key=lambda info: info.name, scope="Targets")
    answer: dict = {
        "Targets": [target_shape(call, info, bus.account, bus.region) for info in chunk]
    }
    if token:
        answer["NextToken"] = token
    return answer


async def remove_targets(call: Call, body: dict) -> dict:
    rule = required(body, "Rule")
    # Every id checked before any target is removed: a bad one refuses the request whole.
    ids = [checked(target_id, "Ids", str) for target_id in required(body, "Ids", list)]
    if not 1 <= len(ids) <= MAX_REMOVE:
        raise validation(f"member 'Ids' must hold 1 to {MAX_REMOVE} target ids")
    bus = await rule_bus(call, body)
    await call.db(catalog.get_rule, bus.name, rule)
    failed = []
    for target_id in ids:
        try:
            await call.db(catalog.delete_target, bus.name, rule, target_id)
        except ApiError as exc:
            failed.append(
                {"TargetId": target_id, "ErrorCode": exc.code, "ErrorMessage": exc.message}
            )
    return {"FailedEntryCount": len(failed), "FailedEntries": failed}


OPERATIONS = {
    "PutTargets": put_targets,
    "ListTargetsByRule": list_targets_by_rule,
    "RemoveTargets": remove_targets,
}
