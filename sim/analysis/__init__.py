"""Pure functions of a recorded run: intervals, exposed communication, bubbles, memory
overheads, cost and claims (no matplotlib, no files)."""
