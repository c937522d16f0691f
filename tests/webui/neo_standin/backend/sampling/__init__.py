"""Stand-in of Neo's ``backend/sampling`` package (sampling_function.py)."""
