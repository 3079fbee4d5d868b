"""Pictures and videos on the front end's side: loading and fetching media, image and video
preprocessing, the processor that turns a conversation into ids and items, the item types and a prompt's
ids padded for its items (their content hashes and caches: `mm_cache/`)."""
