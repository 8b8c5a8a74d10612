"""moeplug.tui: the Textual dashboard of served models, their expert slots, hit rates and GPUs.

`moeplug tui` runs it. `app.py` builds the App, `screens/` holds the main screen and the modal
ones, `widgets/` one panel per file; the data comes from moeplug.serving.monitor and every action calls
the library function its CLI command calls (moeplug.operations.install, moeplug.serving.launch).
"""
