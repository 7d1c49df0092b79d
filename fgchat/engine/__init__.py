"""Inference engine. Invariant: nothing in this package imports Textual or Rich."""
