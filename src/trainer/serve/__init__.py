"""`python -m trainer.serve`: the embedded engine behind tinker 0.38's HTTP protocol (see app.py)."""
