"""The validated options tree of gemini_dcp, and the only reader of ``GEMINI_DCP_*`` variables."""
