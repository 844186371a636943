"""Talking to the live broker: connecting, reading a vhost's state, diffing it with the plan and
declaring what the plan needs."""
