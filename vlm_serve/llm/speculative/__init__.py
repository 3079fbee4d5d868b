"""Speculative decoding: draft tokens proposed cheaply (from the request's own tokens, or a draft model),
then verified in one target forward, keeping exactly what the target would have produced."""
