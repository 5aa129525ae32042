"""What the validate stage uses besides Great Expectations itself: the Data Docs site made to
open offline (data_docs)."""
