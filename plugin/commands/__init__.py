"""The `moeplug` command line: parsing and rendering only; the work is in the rooms below."""
