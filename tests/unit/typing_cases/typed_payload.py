"""What a user's type checker must learn from a consumer (checked by test_public_api.py)."""

from pydantic import BaseModel

from rabbit_retry import Delivery, RetryConsumer, run


class Order(BaseModel):
    id: int


class Charge(RetryConsumer[Order]):
    queue = "payments.charge"
    model = Order

    async def handle(self, delivery: Delivery[Order]) -> None:
        reveal_type(delivery.payload)  # noqa: F821


class Untyped(RetryConsumer):
    queue = "orders"

    def handle(self, delivery: Delivery) -> None:  # a blocking handler is a plain def
        reveal_type(delivery.payload)  # noqa: F821


run([Charge(), Untyped()], topology="t.yml", grace=5.0)
run([Charge()], topology="t.yml", graze=5.0)  # a misspelt option: an error
