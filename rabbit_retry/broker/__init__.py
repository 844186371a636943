"""Talking to the live broker: the management API, AMQP declarations and the plan-vs-live diff."""
