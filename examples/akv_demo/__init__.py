"""The AKV demo harness: a shipment-record chase driven through a CachePolicy (see examples/demo.py)."""
