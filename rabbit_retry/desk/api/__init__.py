"""The desk's HTTP side as FastAPI routers: pages and sessions, reading, acting; the guard that
says who a request is and what it may do; the edge that checks Host and bounds bodies."""
