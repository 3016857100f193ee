"""Rules: ``PutRule`` (creates or updates), ``DescribeRule``, ``ListRules``, ``EnableRule``,
``DisableRule``, ``DeleteRule`` (refused while targets remain, as AWS), and
``ListRuleNamesByTarget``, onto the catalog's rule functions (the CLI's).

Only event patterns: a ``ScheduleExpression`` (a scheduled rule) is refused. ``RoleArn`` and
``Tags`` are accepted and not kept (IAM roles and tags mean nothing here).
"""

from __future__ import annotations

import json

from eventpush import catalog
from eventpush.api.destinations import name_of_arn
from eventpush.api.errors import ApiError, validation
from eventpush.api.service import BusView, Call
from eventpush.api.shapes import (
    bus_name,
    check_owner,
    described,
    optional,
    page,
    required,
    url_of_arn,
)
from eventpush.rules.transforms import rule_arn_for

STATES = ("ENABLED", "DISABLED")


async def rule_bus(call: Call, body: dict) -> BusView:
    name, claimed = bus_name(body)
    bus = await call.bus(name)
    check_owner(claimed, bus.account, bus.region, f"event bus {name}")
    return bus


def rule_shape(bus: BusView, info) -> dict:
    return {
        "Name": info.name,
        "Arn": rule_arn_for(info.name, bus.name, bus.account, bus.region),
        "EventPattern": json.dumps(info.pattern),
        "State": info.state,
        **described(info.description),
        "EventBusName": bus.name,
    }


def compiled_pattern(text: str):
    """The pattern compiled, or InvalidEventPatternException saying why not."""
    from eventpush.patterns import InvalidPatternError, compile_pattern

    try:
        return compile_pattern(text)
    except InvalidPatternError as exc:
        message = f"Event pattern is not valid: {exc}"
        raise ApiError("InvalidEventPatternException", message) from None


async def put_rule(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    if body.get("ScheduleExpression"):
        raise validation("ScheduleExpression is not supported by eventpush: rules match events")
    text = optional(body, "EventPattern")
    state = optional(body, "State")
    if state is not None and state not in STATES:
        raise validation(f"member 'State' must be ENABLED or DISABLED, got {state[:40]!r}")
    description = optional(body, "Description")
    bus = await rule_bus(call, body)
    pattern = None
    if text is not None:
        compiled_pattern(text)
        pattern = json.loads(text)

    if pattern is None:
        raise validation("Parameter(s) EventPattern or ScheduleExpression must be specified.")

    def create_or_update(conn) -> None:
        # As AWS: an update replaces the rule whole, so what the call omits (Description,
        # State) is reset to its default, not kept from before.
        fields = dict(description=description or "", enabled=state != "DISABLED")
        try:
            catalog.get_rule(conn, bus.name, name)
        except catalog.NotFoundError:
            catalog.create_rule(conn, bus.name, name, pattern, **fields)
            return
        catalog.update_rule(conn, bus.name, name, pattern=pattern, **fields)

    await call.db(create_or_update)
    return {"RuleArn": rule_arn_for(name, bus.name, bus.account, bus.region)}


async def describe_rule(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    bus = await rule_bus(call, body)
    info = await call.db(catalog.get_rule, bus.name, name)
    return {**rule_shape(bus, info), "CreatedBy": bus.account}


async def list_rules(call: Call, body: dict) -> dict:
    prefix = optional(body, "NamePrefix")
    bus = await rule_bus(call, body)
    infos = await call.db(catalog.list_rules, bus.name, name_prefix=prefix or None)
    chunk, token = page(infos, body, key=lambda info: info.name, scope="Rules")
    answer: dict = {"Rules": [rule_shape(bus, info) for info in chunk]}
    if token:
        answer["NextToken"] = token
    return answer


async def _set_enabled(call: Call, body: dict, enabled: bool) -> dict:
    name = required(body, "Name")
    bus = await rule_bus(call, body)
    await call.db(catalog.set_rule_enabled, bus.name, name, enabled)
    return {}


async def enable_rule(call: Call, body: dict) -> dict:
    return await _set_enabled(call, body, True)


async def disable_rule(call: Call, body: dict) -> dict:
    return await _set_enabled(call, body, False)


async def delete_rule(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    bus = await rule_bus(call, body)
    try:
        await call.db(catalog.delete_rule, bus.name, name)
    except ApiError as exc:
        if exc.code == "ConcurrentModificationException":
            # AWS's answer for a rule that still has targets.
            raise validation("Rule can't be deleted since it has targets.") from None
        if exc.code != "ResourceNotFoundException":
            raise
        # On AWS deleting a rule that is not there succeeds; only a missing bus is refused
        # (read again: the cached one may have been deleted since).
        await call.bus(bus.name, fresh=True)
    return {}


async def list_rule_names_by_target(call: Call, body: dict) -> dict:
    arn = required(body, "TargetArn")
    bus = await rule_bus(call, body)
    if ":api-destination/" in arn:  # as PutTargets reads a target's Arn
        destination = name_of_arn(arn, "api-destination", bus.account, bus.region)
        names = await call.db(
            catalog.rule_names_by_target_url, bus.name, None, destination=destination
        )
    else:
        url = url_of_arn(arn, bus.account, bus.region)
        names = await call.db(catalog.rule_names_by_target_url, bus.name, url)
    chunk, token = page(list(names), body, scope="RuleNames")
    answer: dict = {"RuleNames": chunk}
    if token:
        answer["NextToken"] = token
    return answer


OPERATIONS = {
    "PutRule": put_rule,
    "DescribeRule": describe_rule,
    "ListRules": list_rules,
    "EnableRule": enable_rule,
    "DisableRule": disable_rule,
    "DeleteRule": delete_rule,
    "ListRuleNamesByTarget": list_rule_names_by_target,
}
