"""The data path: chats -> token shards -> memory-mapped dataset -> batch plan -> collate."""
