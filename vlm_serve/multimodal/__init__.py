"""Pictures and videos on the front end's side: loading and fetching media, image and video
preprocessing, the processor that turns a conversation into ids and items, the item types, content
hashing and the processed-input and embedding caches."""
