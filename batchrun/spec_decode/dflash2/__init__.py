"""DFlash2 drafting: DFlash's block drafting with a candidate selector's walk over each draft
position's top-K tokens (walk.py)."""
