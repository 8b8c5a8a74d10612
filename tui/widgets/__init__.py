"""The dashboard's panels, one per module."""
