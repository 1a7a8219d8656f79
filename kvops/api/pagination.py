"""The REST API's list pages: ?limit=&offset=, bounded so that any number a client sends
gets a page (SQLite refuses integers past 64 bits: an unbounded limit or offset was a 500)."""
from rest_framework.pagination import LimitOffsetPagination


class Pagination(LimitOffsetPagination):
    max_limit = 1000  # a larger limit gets this many
    max_offset = 2 ** 62  # past any row; a larger offset gets an empty page

    def get_offset(self, request) -> int:
        return min(super().get_offset(request), self.max_offset)
