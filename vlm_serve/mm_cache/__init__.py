"""The multimodal cache: content hashes of media under their processing settings, the pad values made from
them, and the size-bounded, single-flight caches they key (processed inputs on the front end, vision
embeddings beside the scheduler)."""
