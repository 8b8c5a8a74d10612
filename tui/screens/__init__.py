"""The dashboard's screens: the main one and its dialogs."""
