"""The operator's verbs over a parking queue: show, replay, purge, export.

Every verb reads parked messages with ``basic.get`` (no auto-ack) on one channel and requeues
whatever it did not act on when it is done, so a message is only ever removed after its fate is
settled (an ack after a confirmed replay, or a purge the operator asked for).
"""
