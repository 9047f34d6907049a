"""BAGEL (ByteDance-Seed): a mixture-of-transformers model that answers text and generates or
edits images by flow matching in the same network (see model.py)."""
