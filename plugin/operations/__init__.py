"""What moeplug does for the user, end to end: install, re-profile, schedule, bench; the actions behind every front end."""
