"""Orgs and API keys: the registry topics every gateway materialises, and the admin use cases that write them."""
