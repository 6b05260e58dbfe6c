"""End-to-end runs built from the other wings: ``quickstart`` and its time-budget planner. The top wing:
nothing in the package imports it but the CLI.
"""
