//! A model's tokenizer folder on disk, as both programs read it: the sidecar hands out the files
//! of its engine's folder, a router may be configured with a folder of its own. One reader, so
//! the two cannot differ on which files count.

use std::io;
use std::path::Path;

use kvsight_protocol::tokenizer_transfer::TokenizerFiles;

/// Reads `tokenizer.json` (required), `tokenizer_config.json` and `chat_template.jinja`
/// (optional: absent is `None`, unreadable is an error).
pub fn read(dir: &Path) -> io::Result<TokenizerFiles> {
    let optional = |name: &str| match std::fs::read(dir.join(name)) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    };
    Ok(TokenizerFiles {
        tokenizer_json: std::fs::read(dir.join("tokenizer.json"))?,
        tokenizer_config: optional("tokenizer_config.json")?,
        chat_template: optional("chat_template.jinja")?,
    })
}
