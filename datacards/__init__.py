"""Data cards: statistics from the warehouse (``stats``) rendered as Markdown + YAML, JSON and HTML
with plots (``render``, ``plots``); ``card.build_card`` writes them. Reads the catalog, never writes
to a layer."""
