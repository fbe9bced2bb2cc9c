"""CLI command groups; each module's functions parse options and call the API."""
