"""The Nexmark benchmark's events and queries on Onceflow (see ``queries.py``)."""
