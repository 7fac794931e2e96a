"""Which draft serves a request: by its declared domain (:mod:`.domains`) or by what it says
(:mod:`.content`: clusters of prompt embeddings, drift, provisional routes). Nothing here knows
drafts or learners; the pool (:mod:`onlinespec.online.pool`) holds those."""
