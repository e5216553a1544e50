"""FairScale FSDP (placeholder until the schedule builder lands; registers nothing yet)."""
