"""`canary fuzz`: generated scenarios (generate), an oracle without expectations (oracle), and
campaigns that keep and shrink what they find (campaign)."""
