"""Loaded at start-up by every Python process of a server started with `request_faults.server_env()`."""

import request_faults

request_faults.install()
