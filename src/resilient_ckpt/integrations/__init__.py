"""Integrations with training frameworks (each imports its framework only when imported)."""
