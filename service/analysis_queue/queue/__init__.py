"""The queue's decisions as the service drives them: admit, promote, release, finish."""
