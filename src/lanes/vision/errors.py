"""`MediaRejected`: the one error for images and videos we refuse, by a stable code."""

# Every code with its fixed message; the HTTP layer maps codes to its own frozen words.
CODES: dict[str, str] = {
    "image_unreadable": "the image could not be decoded as JPEG or PNG",
    "image_truncated": "the image data is truncated or corrupt",
    "image_format": "only JPEG and PNG images are accepted",
    "image_too_large": "the image has too many pixels",
    "image_aspect_ratio": "the image is too narrow: one side is over 200 times the other",
    "video_unreadable": "the video could not be decoded as mp4",
    "video_no_stream": "the file has no video stream",
    "video_too_short": "the video has too few frames",
    "video_too_long": "the video has too many frames",
    "video_too_large": "the video's frames have too many pixels",
    "video_aspect_ratio": "the video is too narrow: one side is over 200 times the other",
}


class MediaRejected(ValueError):
    """An image or video refused; `code` is one of `CODES` and `str(err)` its fixed message.

    Codes: image_unreadable (not an image Pillow knows), image_truncated (header fine, pixels
    not), image_format (an image, but not JPEG or PNG), image_too_large (over the pixel limit,
    checked before decoding), image_aspect_ratio (smart_resize refuses it), video_unreadable
    (not an mp4 av can demux and decode), video_no_stream, video_too_short (fewer frames than
    one temporal patch), video_too_long (over the decoded-frame limit), video_too_large (a frame
    or the sampled frames together over their pixel limits), video_aspect_ratio.
    """

    def __init__(self, code: str) -> None:
        if code not in CODES:
            raise KeyError(code)
        super().__init__(CODES[code])
        self.code = code
