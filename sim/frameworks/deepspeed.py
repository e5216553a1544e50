"""DeepSpeed ZeRO (placeholder until the schedule builder lands; registers nothing yet)."""
