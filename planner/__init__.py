"""`splitserve planner`: sets how many prefill and how many decode workers run, from their own signals."""
