from shatter.checkout import subpackage_only

subpackage_only(__name__, "shatter.tools")
