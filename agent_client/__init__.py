"""agent_client package."""
