//! What an answer says it used: OpenAI's `usage` object, as vLLM, SGLang and TGI's OpenAI
//! routes send it (prompt tokens, completion tokens, and the prompt tokens the engine found in
//! its prefix cache, `prompt_tokens_details.cached_tokens`).
//!
//! It comes at the end of an answer: in a whole answer's JSON document, or in the last event of
//! a stream (vLLM with `stream_options.include_usage` or `--enable-force-include-usage`). The
//! proxy passes bodies through untouched, so [`UsageScan`] looks at each data frame as it goes by
//! and reads the numbers after the `"usage"` key with a byte search: no JSON parse, no copy, and
//! nothing at all for a frame without the key. A key split across two frames is missed (the
//! answer then tells the strategy nothing), as is a `usage` object nested in another one.

use memchr::memmem;

/// The token counts of one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens, as the engine counted them.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// Prompt tokens the engine found in its prefix cache, when it says
    /// (`prompt_tokens_details.cached_tokens`).
    pub cached_tokens: Option<u64>,
}

/// Looks for the `usage` of an answer in its frames.
#[derive(Debug, Clone, Copy, Default)]
pub struct UsageScan {
    found: Option<Usage>,
}

impl UsageScan {
    /// Reads `frame`: the last usage found in any frame wins (a stream's usage event comes last).
    pub fn frame(&mut self, frame: &[u8]) {
        if let Some(usage) = find(frame) {
            self.found = Some(usage);
        }
    }

    /// The usage found, if any.
    pub fn usage(&self) -> Option<Usage> {
        self.found
    }
}

/// The usage in `bytes`: the numbers of the object after the last `"usage"` key, when it holds
/// at least `prompt_tokens`.
pub fn find(bytes: &[u8]) -> Option<Usage> {
    let at = memmem::rfind(bytes, b"\"usage\"")?;
    let object = &bytes[at + b"\"usage\"".len()..];
    let end = object_end(object)?;
    let object = &object[..end];
    Some(Usage {
        prompt_tokens: number_after(object, b"\"prompt_tokens\"")?,
        completion_tokens: number_after(object, b"\"completion_tokens\"").unwrap_or(0),
        cached_tokens: number_after(object, b"\"cached_tokens\""),
    })
}

/// The length of the object that starts after `:` and spaces, up to its closing brace; `None`
/// when `bytes` does not open an object or it does not close within them.
fn object_end(bytes: &[u8]) -> Option<usize> {
    let open = bytes.iter().position(|&b| !matches!(b, b' ' | b':'))?;
    if bytes[open] != b'{' {
        return None;
    }
    let mut depth = 0usize;
    for (at, &byte) in bytes.iter().enumerate().skip(open) {
        match byte {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(at + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The unsigned integer after `key` and its colon in `object`.
fn number_after(object: &[u8], key: &[u8]) -> Option<u64> {
    let at = memmem::find(object, key)? + key.len();
    let rest = &object[at..];
    let start = rest.iter().position(|&b| !matches!(b, b' ' | b':'))?;
    let digits = rest[start..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    if digits == 0 || digits > 19 {
        return None;
    }
    std::str::from_utf8(&rest[start..start + digits])
        .ok()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_answers_usage_is_read_with_its_cached_tokens() {
        let body = br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"a \"usage\": 9"}}],"usage":{"prompt_tokens":1200,"total_tokens":1264,"completion_tokens":64,"prompt_tokens_details":{"cached_tokens":1024}}}"#;
        assert_eq!(
            find(body),
            Some(Usage {
                prompt_tokens: 1200,
                completion_tokens: 64,
                cached_tokens: Some(1024),
            })
        );
    }

    #[test]
    fn a_streams_last_event_carries_it_and_earlier_frames_do_not() {
        let mut scan = UsageScan::default();
        scan.frame(b"data: {\"choices\":[{\"delta\":{\"content\":\" tok\"}}]}\n\n");
        assert_eq!(scan.usage(), None);
        scan.frame(b"data: {\"choices\":[],\"usage\": {\"prompt_tokens\": 30, \"completion_tokens\": 2, \"prompt_tokens_details\": null}}\n\ndata: [DONE]\n\n");
        assert_eq!(
            scan.usage(),
            Some(Usage {
                prompt_tokens: 30,
                completion_tokens: 2,
                cached_tokens: None,
            })
        );
        scan.frame(b"data: [DONE]\n\n");
        assert!(
            scan.usage().is_some(),
            "a later frame without usage keeps it"
        );
    }

    #[test]
    fn what_is_not_a_usage_object_is_none() {
        for bytes in [
            &b"{\"usage\": null}"[..],
            b"{\"usage\": {\"completion_tokens\": 3}}",
            b"{\"usage\": {\"prompt_tokens\": 12",
            b"{\"usage\": {\"prompt_tokens\": -1}}",
            b"{\"usage\": {\"prompt_tokens\": 99999999999999999999999}}",
            b"no usage here",
        ] {
            assert_eq!(find(bytes), None, "{}", String::from_utf8_lossy(bytes));
        }
    }
}
