"""What the worker checks of a consumer before its first message: a consumer it cannot run is
refused with one line (exit 2 from the command line), never found out message by message."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import BaseModel

from rabbit_retry.errors import InputError
from rabbit_retry.worker import Delivery, RetryConsumer
from rabbit_retry.worker.consumer import check_consumer

if TYPE_CHECKING:
    from decimal import Decimal  # as ruff's TCH rules move it: pydantic cannot see it


class Order(BaseModel):
    id: int


class Refund(BaseModel):
    id: int


class Lazy(BaseModel):
    id: int
    total: Decimal


def test_the_type_argument_is_the_model_when_model_is_not_set() -> None:
    class Charge(RetryConsumer[Order]):
        queue = "q"

        async def handle(self, delivery: Delivery[Order]) -> None: ...

    adapter = check_consumer(Charge())
    assert adapter is not None
    assert adapter.validate_json(b'{"id": 7}') == Order(id=7)


def test_a_subclass_of_a_typed_consumer_keeps_its_model() -> None:
    class Base(RetryConsumer[Order]):
        queue = "q"

    class Charge(Base):
        async def handle(self, delivery: Delivery[Order]) -> None: ...

    adapter = check_consumer(Charge())
    assert adapter is not None and adapter.validate_json(b'{"id": 1}') == Order(id=1)


@pytest.mark.parametrize("argument", [None, Any])
def test_no_type_argument_means_no_model(argument: Any) -> None:
    base = RetryConsumer if argument is None else RetryConsumer[argument]

    class Plain(base):  # type: ignore[valid-type,misc]
        queue = "q"

        async def handle(self, delivery: Delivery) -> None: ...

    assert check_consumer(Plain()) is None


def test_a_model_that_disagrees_with_the_type_argument_is_refused() -> None:
    class Charge(RetryConsumer[Order]):
        queue = "q"
        model = Refund  # type: ignore[assignment]

        async def handle(self, delivery: Delivery[Order]) -> None: ...

    with pytest.raises(InputError) as refused:
        check_consumer(Charge())
    assert str(refused.value) == (
        "Charge: model = 'Refund' but the class says RetryConsumer[Order]; say it once, or agree"
    )


def test_a_model_given_as_a_string_is_refused() -> None:
    class Charge(RetryConsumer):
        queue = "q"
        model = "Order"  # type: ignore[assignment]

        async def handle(self, delivery: Delivery) -> None: ...

    with pytest.raises(InputError) as refused:
        check_consumer(Charge())
    assert str(refused.value) == "Charge.model: 'Order' is a string; assign the class itself"


def test_a_model_pydantic_cannot_build_is_refused_at_start() -> None:
    """The issue's stall: a field type imported under TYPE_CHECKING. It type-checks, and
    pydantic only fails when the first message is validated; now the start fails."""

    class Charge(RetryConsumer[Lazy]):
        queue = "q"

        async def handle(self, delivery: Delivery[Lazy]) -> None: ...

    with pytest.raises(InputError) as refused:
        check_consumer(Charge())
    message = str(refused.value)
    assert message.startswith("Charge.model: pydantic cannot build a validator for ")
    assert "name 'Decimal' is not defined" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("signature", "ok"),
    [("self, delivery", True), ("self, delivery, retries=3", True), ("self, *args", True),
     ("self", False), ("self, delivery, extra", False), ("self, *, delivery", False)],
)
def test_handle_must_take_one_delivery(signature: str, ok: bool) -> None:
    namespace: dict[str, Any] = {}
    exec(f"async def handle({signature}): pass", namespace)
    Shaped = type("Shaped", (RetryConsumer,), {"queue": "q", "handle": namespace["handle"]})
    if ok:
        check_consumer(Shaped())
        return
    with pytest.raises(InputError) as refused:
        check_consumer(Shaped())
    assert str(refused.value).startswith("Shaped.handle(")
    assert "the worker calls it with one delivery" in str(refused.value)


def test_a_decorated_handle_is_checked_through_its_wrapper() -> None:
    def traced(handle: Any) -> Any:
        @functools.wraps(handle)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return handle(*args, **kwargs)

        return wrapper

    class Traced(RetryConsumer):
        queue = "q"

        @traced
        async def handle(self, delivery: Delivery) -> None: ...

    assert check_consumer(Traced()) is None
