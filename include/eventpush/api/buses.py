"""Event buses: ``CreateEventBus``, ``DescribeEventBus``, ``ListEventBuses``,
``DeleteEventBus``, onto the catalog's bus functions (the CLI's).

A bus made here has ``DEFAULT_QUEUES`` queues in the built-in PostgreSQL store; a bus on
JetStream, or with another number of queues, is made with ``eventpush bus create``. The bus
``default`` (made by ``eventpush db migrate``) cannot be deleted, as on AWS.
"""

from __future__ import annotations

from eventpush import catalog
from eventpush.api.errors import validation
from eventpush.api.service import Call
from eventpush.api.shapes import (
    DEFAULT_BUS,
    bus_arn,
    bus_name,
    check_owner,
    described,
    optional,
    page,
    required,
    timestamp,
)

DEFAULT_QUEUES = 4
UNSUPPORTED = ("EventSourceName", "KmsKeyIdentifier", "DeadLetterConfig", "LogConfig")


def bus_shape(info) -> dict:
    return {
        "Name": info.name,
        "Arn": bus_arn(info.account, info.region, info.name),
        **described(info.description),
        "CreationTime": timestamp(info.created_at),
        "LastModifiedTime": timestamp(info.created_at),
    }


async def create_event_bus(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    description = optional(body, "Description", str, "")
    for member in UNSUPPORTED:
        if body.get(member):
            raise validation(f"member '{member}' is not supported by eventpush")
    await call.db(
        catalog.create_bus,
        name,
        DEFAULT_QUEUES,
        description,
        account=call.settings.account,
        region=call.settings.region,
    )
    info = (await call.bus(name, fresh=True)).info
    return {"EventBusArn": bus_arn(info.account, info.region, name), **described(description)}


async def describe_event_bus(call: Call, body: dict) -> dict:
    name, claimed = bus_name(body, "Name")
    bus = await call.bus(name, fresh=True)
    check_owner(claimed, bus.account, bus.region, f"event bus {name}")
    return bus_shape(bus.info)


async def list_event_buses(call: Call, body: dict) -> dict:
    prefix = optional(body, "NamePrefix", str, None)
    infos = await call.db(catalog.list_buses, name_prefix=prefix or None)
    chunk, token = page(infos, body, key=lambda info: info.name, scope="EventBuses")
    answer: dict = {"EventBuses": [bus_shape(info) for info in chunk]}
    if token:
        answer["NextToken"] = token
    return answer


async def delete_event_bus(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    if name == DEFAULT_BUS:
        raise validation("Cannot delete event bus default.")
    await call.db(catalog.delete_bus, name)
    call.service.buses.drop(name)
    return {}


OPERATIONS = {
    "CreateEventBus": create_event_bus,
    "DescribeEventBus": describe_event_bus,
    "ListEventBuses": list_event_buses,
    "DeleteEventBus": delete_event_bus,
}
