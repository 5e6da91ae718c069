"""Generated stubs of the public generation service (``make proto``; do not edit)."""
