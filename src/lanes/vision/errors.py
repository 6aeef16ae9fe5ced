"""`MediaRejected`: the one error for images and videos we refuse, by a stable code.

The words a client sees for each code are frozen in the HTTP layer's errors module (`MEDIA_WORDS`).
"""

CODES: tuple[str, ...] = (
    "image_unreadable",  # not an image Pillow knows
    "image_truncated",  # the header is fine, the pixels are not
    "image_format",  # an image, but not JPEG or PNG
    "image_too_large",  # over the pixel limit, checked before decoding
    "image_aspect_ratio",  # smart_resize refuses it
    "video_unreadable",  # not an mp4 av can demux and decode
    "video_malformed",  # a box declares counts its bytes cannot hold, or past a structural limit (mp4_probe)
    "video_codec",  # the video track's codec is not one av decodes here
    "video_no_stream",
    "video_too_short",  # fewer frames than one temporal patch
    "video_too_long",  # over the decoded-frame limit
    "video_too_large",  # a frame, or the sampled frames together, over their pixel limits
    "video_aspect_ratio",
    "media_over_budget",  # decoding it would cost more than the server's whole decode budget (--media-decode-bytes)
)


class MediaRejected(ValueError):
    """An image or video refused; `code` is one of `CODES` (and `str(err)` is the code)."""

    def __init__(self, code: str) -> None:
        if code not in CODES:
            raise KeyError(code)
        super().__init__(code)
        self.code = code
