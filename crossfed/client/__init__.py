"""The coordinator's clients: requests, parallel and presigned transfers, and how to reach
a run's coordinator (its URL and the caller's token)."""
