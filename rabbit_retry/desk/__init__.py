"""The failure desk: parked messages into a store, grouped by cause, replayed or discarded by an
operator, with an audit of who did what."""
