"""The API-server side (and the offline ``LLM``'s front end): admission, OpenAI fields, metrics.

Runs where requests arrive. It imports no EngineCore or worker module (an import-linter
contract): what it refuses is decided from data bound at install time.
"""
