"""Routing: the decision (which instance an attempt goes to, admitted by priority) and its
explanation."""
