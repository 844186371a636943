"""Talking to the live broker: connecting, checking that the AMQP and management URLs reach one
broker, reading a vhost's state (and exact counts), diffing it with the plan and declaring what
the plan needs."""
